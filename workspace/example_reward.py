"""An example reward function for `reward.rules` (`name: "example_reward:score"`): 1.0 when the
last number in the response equals the label's, else 0.0, minus 0.001 a character beyond 200.

The reward service imports it from the mounted workspace (/workspace is on PYTHONPATH) and calls
it once per sample; `kwargs` are the rule's `kwargs` from the config."""
import re


def score(prompt: str, response: str, label: str | None, metadata: dict, max_chars: int = 200) -> float:
    numbers = re.findall(r"-?\d+(?:\.\d+)?", response.replace(",", ""))
    correct = bool(numbers) and label is not None and float(numbers[-1]) == float(label)
    return float(correct) - 0.001 * max(0, len(response) - max_chars)
