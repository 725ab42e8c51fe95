import pytest

from . import manifests as m


@pytest.fixture(scope="session")
def k8s_tree(tmp_path_factory):
    """A copy of deploy/k8s with test secrets and one overlay per variant (overlay + components)."""
    return m.make_tree(tmp_path_factory.mktemp("deploy"))


@pytest.fixture(scope="session")
def rendered(k8s_tree):
    """Every variant's `kubectl kustomize` output: {variant: YAML text}."""
    return {v: m.render(k8s_tree, v) for v in m.VARIANTS}


@pytest.fixture(scope="session")
def docs(rendered):
    """Every variant's objects: {variant: [dict, ...]}."""
    return {v: m.load_docs(text) for v, text in rendered.items()}
