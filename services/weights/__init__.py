"""Weight transfer: a policy version from the learner to the generation servers. It imports only
`services.common`; the learner calls the publisher, the generation server is an adapter over the
receiver.

    protocol.py   what both ends agree on: formats, the chunk size, dtype tables, checksums, file names
    check.py      the one check of a version: header, names/shapes/dtypes, coverage, finiteness
    stream.py     the gRPC push stream, both ends: encode, fan out, decode, assemble
    delta.py      delta pushes (rpc.delta_push): a piece as its XOR with the server's version, zstd
    shm.py        shared memory on one host, both ends: writer, co-location probe, checked read
    hostcopy.py   GPU <-> host copies through page-locked memory
    publisher.py  the learner's side: snapshot, plan, deliver to many servers (transports as
                  strategies), register
    receiver.py   the server's side: the fence (only the run's learner), receive by any transport
                  or pull, check, swap atomically on a backend
"""
