"""An example reward function shipped to the cluster in the rlhf-config ConfigMap (see
kustomization.yaml): `reward.rules: [{name: /etc/rlhf/my_reward.py:score}]`."""


def score(prompt: str, response: str, label: str | None, metadata: dict) -> float:
    """1.0 when the reply, stripped, is the label; else 0.0."""
    return float(label is not None and response.strip() == label.strip())
