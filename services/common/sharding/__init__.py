"""Sharding: a model trained across N processes (GPUs), sharded with FSDP2: the learner's actor and
reference (services/learner/sharded.py), and the critic server's value model (services/critic/sharded.py).

    rlhf serve learner -c FILE --nproc 2      (or model.nproc: 2; or torchrun --nproc-per-node 2)
    rlhf serve critic -c FILE --nproc 2       (or critic.nproc: 2)

For the learner, rank 0 is the learner service: it reads the replay buffer, owns the ledger, pushes weights,
evaluates and serves gRPC. Ranks 1..N-1 are followers: they hold their shards of the model and
of the optimiser state, and run the calls rank 0 announces (`collective` methods of
`ShardedPolicyTrainer`: a step on a batch, a full state dict for a push, a sharded save or load) on a
control channel (a gloo group that waits as long as rank 0 waits for data). Each rank computes
its share of every batch's rows; FSDP2 averages the gradients, so an update equals the
single-process one on the same batch.

`rlhf serve learner --nproc N` starts the followers itself (each dies with rank 0: a crashed
learner takes its followers down, and the supervisor restarts the whole group); under torchrun
(multi-node) the usual RANK / WORLD_SIZE / MASTER_ADDR environment is used instead. CPU runs use
the gloo backend, GPU runs NCCL with one GPU per process (LOCAL_RANK).

The parts, one job each:
    group.py       the process group (`Dist`, `from_env`) and each rank's share of a batch's rows
    followers.py   rank 0 and its followers: starting them, announcing calls (`collective`), `follow`, releasing them
    fsdp.py        the model's shards and state: `shard`, `load_and_shard`, full and sharded state dicts, checkpoints
"""
