"""A Tinker-compatible training API (`rlhf serve tinker`, docs/tinker.md): the official `tinker` SDK
trains and samples the configured model through it, unchanged.

    server.py      the service: the generation backend, the API, its HTTP server
    routes.py      the HTTP paths the SDK calls (auth and body limits first: common/rpc/http_guard.py)
    api.py         what each request does: sessions, training models, sampling sessions, futures
    protocol.py    the JSON requests as read (range-checked), the ids, the one error
    wire.py        the SDK's protobuf messages (forward_backward in, its result and a sample's out)
    sequence.py    a training model's requests in seq_id order, each applied once
    futures.py     request results for retrieve_future
    losses.py      cross_entropy, importance_sampling, ppo, cispo
    training.py    a training model: the learner's LoRA and AdamW parts, composed
    sampling.py    sample requests batched, a checkpoint's weights swapped in for them
    decoders.py    what decodes: the hf backend in this process, or a generation server of its own
    checkpoints.py tinker:// paths as directories under tinker.root
"""
