"""The package structure the architecture promises, checked on the source (ast, every import,
also those inside functions):
- every package under services/ has a layer (`LAYERS`), and every import goes down the layers or
  stays in its package: none runs back up, none crosses to another package of the same layer;
- `services.common` imports no service; `services.ppo` imports nothing else of the project;
- `services.weights` (weight transfer) imports only `services.common`;
- a service (generation, reward, critic, teacher, learner, rollout, gateway) imports another service only
  through its `client` module, and client modules
  import no service internals;
- no module imports another module's privates (`from x import _name`);
- no import cycles between modules;
- the data contracts (`services.common.types`) and the gRPC plumbing load without torch;
- `services.training` (the training loop and what it needs) imports only `services.common`;
- `services.common` holds only what is shared: each of its top-level parts (a module, or a
  sub-package taken whole: `replay/`, `rpc/`) is used by 3 or more packages. A *package* here is
  a top-level package under services/ other than `common` (generation, reward, critic, learner,
  rollout, ppo, training, weights, cli, ...) or a composition root module (`launcher`, `local`);
  it *uses* a part when one of its modules imports a module of the part, directly or through
  other `common` modules (`config_sections` is used by whoever imports `config`). The
  exceptions, `SHARED_BY_CONTRACT`, say why;
- one retry/avoid policy for generation servers: only `services.common.servers` picks a server
  or avoids one (its callers go through `Tries`)."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVICES = ("generation", "reward", "critic", "teacher", "learner", "rollout", "gateway")
# every package under services/ (and the composition roots), lowest first: a module imports only
# from its own package or a lower layer, never from its own layer's others or from above
LAYERS = (
    ("ppo",),  # the algorithm: pure tensor functions
    ("common",),  # the shared kernel
    ("weights", "training"),  # moving a policy version; what the training loop needs
    ("agents",),  # sessions, the agents' endpoint, episode loops
    ("generation", "reward", "critic", "teacher"),  # the services others call, through their clients
    ("learner", "rollout", "gateway", "reward_model"),  # the services that call them; offline jobs
    ("tinker",),  # the Tinker-compatible API: the learner's training parts and a generation backend, in one process
    ("launcher", "local"),  # composition roots: the distributed and the in-process wiring
    ("cli",),  # the command, over everything
)
ROOTS = ("services.cli", "services.launcher", "services.local")  # composition roots: wire everything
# common parts shared through the objects every service is handed rather than through imports
SHARED_BY_CONTRACT = {
    "config": "every service is built from a Config (`serve(cfg)`) and reads its sections; the roots load it",
    "config_sections": "the sections of that Config (config.py re-exports them)",
    "userfn": "your code named in a config, loaded one way with one kind of error: reward functions in the "
    "reward service, agents wherever sessions run (agents/host.py: workers, the learner's eval, rlhf eval)",
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports() -> dict[str, set[str]]:
    """module -> project modules it imports (resolved; `from pkg import name` counts as pkg.name
    when that is a module, else pkg)."""
    files = {(_module_name(p)): p for p in (ROOT / "services").rglob("*.py") if "/gen/" not in str(p)}
    known = set(files) | {_module_name(p) for p in (ROOT / "services").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - node.level + 1]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                names = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in known else prefix for a in node.names]
            else:
                continue
            deps.update(n for n in names if n.split(".")[0] == "services" and n != mod)
        graph[mod] = {d for d in deps if d in known}
    return graph


GRAPH = _imports()


def _service_of(mod: str) -> str | None:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in SERVICES else None


def _layer(mod: str) -> int:
    package = mod.split(".")[1]
    return next(i for i, names in enumerate(LAYERS) if package in names)


def test_every_package_has_a_layer():
    packages = {m.split(".")[1] for m in GRAPH if m.count(".") >= 1}
    layered = {name for names in LAYERS for name in names}
    assert packages == layered, (
        f"without a layer: {packages - layered}; a layer's name with no package: {layered - packages}"
    )


def test_no_import_runs_back_up_the_layers():
    """Every import of every package (functions' own included) goes down the layers or stays in
    its package: a package that imports one of its own layer, or one above, is refused."""
    assert _layer("services.agents.host") < _layer("services.gateway.server")  # it tells them apart
    bad = sorted(
        (m, d)
        for m, deps in GRAPH.items()
        if m.count(".") >= 1
        for d in deps
        if d.count(".") >= 1 and d.split(".")[1] != m.split(".")[1] and _layer(d) >= _layer(m)
    )
    assert not bad, f"imports that run back up (or across) the layers: {bad}"


def test_the_graph_sees_the_project():
    assert len(GRAPH) > 40
    assert "services.learner.run" in GRAPH and "services.generation.client" in GRAPH["services.learner.run"]


def test_common_and_ppo_import_no_service():
    bad = [
        (m, d)
        for m, deps in GRAPH.items()
        if m.startswith(("services.common", "services.ppo"))
        for d in deps
        if _service_of(d) or d.startswith(ROOTS)
    ]
    assert not bad, bad
    assert not [
        (m, d)
        for m, deps in GRAPH.items()
        if m.startswith("services.ppo")
        for d in deps
        if not d.startswith("services.ppo")
    ]
    # common is the bottom layer: not even the packages that import only common
    assert not [
        (m, d)
        for m, deps in GRAPH.items()
        if m.startswith("services.common")
        for d in deps
        if d.startswith(("services.weights", "services.training"))
    ]


def test_services_meet_only_through_clients():
    bad = [
        (m, d)
        for m, deps in GRAPH.items()
        if _service_of(m)
        for d in deps
        if _service_of(d) not in (None, _service_of(m)) and not d.endswith(".client")
    ]
    assert not bad, f"a service imports another service's internals: {bad}"


def test_client_modules_import_only_common():
    clients = [m for m in GRAPH if m.endswith(".client") and _service_of(m)]
    assert len(clients) == 4  # generation, reward, critic, teacher (the learner's pull is weights/pull.py)
    bad = [
        (m, d)
        for m in clients
        for d in GRAPH[m]
        if not d.startswith(("services.common", "services.ppo", "services.weights"))
    ]
    assert not bad, bad


def test_weights_imports_only_common():
    mods = [m for m in GRAPH if m.startswith("services.weights")]
    assert {"services.weights.stream", "services.weights.assemble", "services.weights.receiver"} <= set(mods)
    bad = [(m, d) for m in mods for d in GRAPH[m] if not d.startswith(("services.common", "services.weights"))]
    assert not bad, f"services.weights imports beyond services.common: {bad}"


def test_no_module_imports_another_modules_privates():
    """`from x import _name` between project modules (relative or absolute): a private shared
    across files is an interface in hiding; make it public or keep it in one module."""
    bad = []
    for path in (ROOT / "services").rglob("*.py"):
        if "/gen/" in str(path):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == "services"):
                names = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                if names:
                    bad.append((_module_name(path), "." * node.level + (node.module or ""), names))
    assert not bad, bad


def test_no_import_cycles():
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(GRAPH.get(m, ())):
            if state.get(d) == 1:
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(d) :] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)


def test_contracts_and_rpc_plumbing_load_without_torch():
    code = (
        "import sys, services.common.types, services.common.rpc.server, services.common.rpc.client, "
        "services.common.rpc.health, "
        "services.common.lifecycle; assert 'torch' not in sys.modules, 'torch was imported'"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_training_imports_only_common():
    bad = [
        (m, d)
        for m, deps in GRAPH.items()
        if m.startswith("services.training.") or m == "services.training"
        for d in deps
        if not d.startswith(("services.common", "services.training"))
    ]
    assert not bad, bad


def _package_of(mod: str) -> str:
    """The importing package a module belongs to: services.<top>... -> <top>."""
    return mod.split(".")[1]


def _common_part(mod: str) -> str | None:
    """services.common.replay.store -> replay; services.common.config -> config; None outside."""
    parts = mod.split(".")
    return parts[2] if parts[:2] == ["services", "common"] and len(parts) > 2 else None


def common_users() -> dict[str, set[str]]:
    """common part -> the packages that use it (see the module docstring)."""
    importers: dict[str, set[str]] = {}
    for m, deps in GRAPH.items():
        for d in deps:
            importers.setdefault(d, set()).add(m)

    def users(mod: str, seen: set[str]) -> set[str]:
        out = set()
        for m in importers.get(mod, ()):
            if m.startswith("services.common."):
                if m not in seen:
                    seen.add(m)
                    out |= users(m, seen)
            elif m.startswith("services."):
                out.add(_package_of(m))
        return out

    out: dict[str, set[str]] = {}
    for mod in GRAPH:
        part = _common_part(mod)
        if part is not None and not mod.endswith(".build_protos"):  # a build script, run by hand
            out.setdefault(part, set()).update(users(mod, {mod}))
    return out


def test_common_holds_only_what_three_packages_use():
    used = common_users()
    assert {"types", "replay", "rpc", "config"} <= set(used)
    few = {part: sorted(pkgs) for part, pkgs in used.items() if len(pkgs) < 3 and part not in SHARED_BY_CONTRACT}
    assert not few, f"common parts used by fewer than 3 packages (give them an owner): {few}"
    assert all(used[part] for part in SHARED_BY_CONTRACT), "a part shared by contract that no package imports"


# what reads another service's (or Redis's) error as text: its message, its gRPC details
_ERROR_TEXT = re.compile(r"\.details\(\)|\bstr\((e|err|exc|error)\)|\b(e|err|exc|error)\.args\b")


def _error_text_decisions(tree: ast.AST) -> list[str]:
    """`"..." in str(e)`, `e.details() == "..."`, `(e.details() or "").startswith(...)`: code that
    decides on an error's wording."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(
            isinstance(op, (ast.In, ast.NotIn, ast.Eq, ast.NotEq)) for op in node.ops
        ):
            if any(_ERROR_TEXT.search(ast.unparse(side)) for side in (node.left, *node.comparators)):
                found.append(ast.unparse(node))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("startswith", "endswith")
            and _ERROR_TEXT.search(ast.unparse(node.func.value))
        ):
            found.append(ast.unparse(node))
    return found


def test_no_behaviour_keyed_on_an_errors_wording():
    """Contracts between services are data: a caller acts on the status code and the error
    details' `Reason` (services/common/rpc/errors.py), Redis's error code (`redis_error_code`),
    never on a message that a reworded sentence would silently change."""
    assert _error_text_decisions(
        ast.parse('if "NOGROUP" in str(e): pass\nok = (e.details() or "").startswith("prompts[")')
    )  # it sees them
    bad = {}
    for path in (ROOT / "services").rglob("*.py"):
        if "/gen/" not in str(path):
            found = _error_text_decisions(ast.parse(path.read_text()))
            if found:
                bad[_module_name(path)] = found
    assert not bad, bad


def test_every_reason_a_service_acts_on_is_pinned_by_a_test():
    """Each `Reason` appears in a test outside this file (a server that must send it, or a caller
    that must act on it)."""
    from services.common.rpc.errors import Reason

    texts = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("*.py") if p.name != "test_structure.py")
    unpinned = [r.name for r in Reason if f"Reason.{r.name}" not in texts]
    assert not unpinned, unpinned


def _back_references(tree: ast.AST) -> list[str]:
    """`Part(self)` inside a class: the class hands itself to a part it builds, which can then
    reach back into its owner (a part that must do that is two parts in one place)."""
    found = []
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id[:1].isupper():
                passed = [*node.args, *(k.value for k in node.keywords)]
                if any(isinstance(a, ast.Name) and a.id == "self" for a in passed):
                    found.append(f"{cls.name}: {ast.unparse(node)}")
    return found


def test_no_part_is_handed_its_owner():
    """Parts are composed: an owner hands a part what it needs (data, callables, other parts),
    never itself; and the training loop is not subclassed (the learner service composes it)."""
    assert _back_references(ast.parse("class A:\n    def __init__(self):\n        self.b = Part(self)\n"))
    bad = {}
    for path in (ROOT / "services").rglob("*.py"):
        if "/gen/" not in str(path):
            tree = ast.parse(path.read_text())
            found = _back_references(tree)
            found += [
                f"{n.name} subclasses {ast.unparse(b)}"
                for n in ast.walk(tree)
                if isinstance(n, ast.ClassDef)
                for b in n.bases
                if ast.unparse(b).split(".")[-1] == "TrainingLoop"
            ]
            if found:
                bad[_module_name(path)] = found
    assert not bad, bad


# what chooses a generation server: a pool's pick, and its avoidance of one that failed
_CHOOSING = ("pick", "avoid")


def _server_choices(tree: ast.AST) -> list[str]:
    """`x.pick(...)`, `x.avoid(...)`: a server chosen, or shut out, by hand."""
    return [
        ast.unparse(n)
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in _CHOOSING
    ]


def test_one_retry_and_avoid_policy_chooses_generation_servers():
    """Which server to try next, which to avoid after a failure and how long, how many tries: the
    rollout worker, the gateway and the learner's eval each go through `Tries` under a
    `RetryPolicy` (services/common/servers.py), none picks or avoids a server itself."""
    assert _server_choices(ast.parse("a = self.servers.pick(3)\nself.servers.avoid(a, 1.0)"))  # it sees them
    owner = ROOT / "services" / "common" / "servers.py"
    assert _server_choices(ast.parse(owner.read_text()))
    bad = {}
    for path in (ROOT / "services").rglob("*.py"):
        if "/gen/" not in str(path) and path != owner:
            found = _server_choices(ast.parse(path.read_text()))
            if found:
                bad[_module_name(path)] = found
    assert not bad, bad
