"""Weight transfer: a policy version from the learner to the generation servers. It imports only
`services.common`; the learner calls the publisher, the generation server is an adapter over the
receiver.

    protocol.py   what both ends agree on: formats, the chunk size, dtype tables, checksums, file names
    check.py      the one check of a version: header, names/shapes/dtypes, coverage, finiteness
    stream.py     the gRPC push stream, the sender: encode, fan out
    decoder.py    the gRPC push stream, the receiver's deserializer: pieces without a copy
    assemble.py   the gRPC push stream, the receiver: a checked state dict from its pieces
    delta.py      delta pushes (rpc.delta_push): a piece as its XOR with the server's version, zstd
    shm_writer.py shared memory on one host, the learner's side: the file written once, checksummed
    shm.py        shared memory on one host: co-location probe, the server's mappings, checked read
    hostcopy.py   GPU <-> host copies through page-locked memory
    publisher.py  the learner's side: snapshot, plan, deliver to many servers, register
    transports.py its transports, strategies with one interface: the stream, shared memory
    deliver.py    a version to every server at once, a second round for what the first could not
    receiver.py   the server's side: the fence (only the run's learner), receive by any transport
                  or pull, check, swap atomically on a backend
    swap.py       an update's waits (the call's deadline) and its swap between batches
"""
