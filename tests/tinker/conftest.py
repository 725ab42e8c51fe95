"""What the Tinker API's tests share: the SDK's telemetry off (nothing leaves the machine), and the
tiny model's tokenizer."""

import pytest

from services.common.model_files import load_tokenizer


@pytest.fixture(scope="module", autouse=True)
def no_telemetry():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINKER_TELEMETRY", "0")
        yield


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)
