import grpc
import pytest

from services.common.config import config_from_dict

TOKEN = "s3cret"


@pytest.fixture(scope="module")
def cfg(tiny_model_dir):
    return config_from_dict({"model": {"path": tiny_model_dir, "device": "cpu"}, "prompt_length": 32,
                             "response_length": 8, "rpc": {"auth_token": TOKEN, "max_samples_per_prompt": 8},
                             "generation": {"batch_window_ms": 50}})


def expect_code(fn, code, fragment=""):
    with pytest.raises(grpc.RpcError) as e:
        fn()
    assert e.value.code() == code, e.value.details()
    assert fragment in (e.value.details() or ""), e.value.details()
    return e.value.details()
