"""The package's shape (docs/architecture.md): layers import only downwards, no import circles,
rules are named functions that declare what they read, and the light commands stay light."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from mbmem_overlays.core import rules
from mbmem_overlays.core.engine import View

from conftest import ROOT

PACKAGE = ROOT / "src" / "mbmem_overlays"
# Lowest first: a module may import its own layer and the layers before it, never a later one.
LAYERS = ("core", "bridge", "api", "memory", "doctor", "launch", "cli")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (PACKAGE.parent / rel).with_suffix(".py").is_file() or (PACKAGE.parent / rel / "__init__.py").is_file()


def imports_of(path: Path) -> set[str]:
    """Every package module ``path`` imports, at module level or inside functions."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            targets = [f"{origin}.{a.name}" if is_module(f"{origin}.{a.name}") else origin for a in node.names]
        else:
            continue
        found |= {t for t in targets if t.split(".")[0] == "mbmem_overlays"}
    return found - {name}


def layer(name: str) -> int | None:
    parts = name.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in PACKAGE.rglob("*.py")}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_circle_in_the_package():
    assert find_cycle(graph()) is None, " -> ".join(find_cycle(graph()))


def test_every_module_belongs_to_a_layer():
    loose = [m for m in graph() if layer(m) is None and m != "mbmem_overlays"]
    assert not loose, f"modules outside the layers {LAYERS}: {loose}"


def test_layers_import_only_downwards():
    upward = [f"{m} ({LAYERS[layer(m)]}) imports {t} ({LAYERS[layer(t)]})"
              for m, targets in graph().items() if layer(m) is not None
              for t in targets if layer(t) is not None and layer(t) > layer(m)]
    assert not upward, "\n".join(upward)


def test_the_checkers_catch_what_they_guard(tmp_path):
    """The two checks above can fail: a planted circle and a planted upward import are found."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    probe = PACKAGE / "core" / "_probe_upward.py"
    probe.write_text("from ..cli import common\nfrom ..memory import model\n")
    try:
        assert imports_of(probe) == {"mbmem_overlays.cli.common", "mbmem_overlays.memory.model"}
        assert layer("mbmem_overlays.cli.common") > layer(module_name(probe))
    finally:
        probe.unlink()


def test_every_check_is_a_named_function_of_its_topic_module():
    ids = [c.id for c in rules.CHECKS]
    assert len(ids) == len(set(ids))
    for c in rules.CHECKS:
        assert c.fn.__name__ == c.id
        module = sys.modules[c.fn.__module__]
        assert getattr(module, c.id) is c.fn, f"{c.id} is not reachable as {c.fn.__module__}.{c.id}"
        assert module in rules.TOPICS, f"{c.id} lives in {c.fn.__module__}, not a topic module"
        assert c.reads, f"{c.id} declares no fields"


def test_light_commands_never_import_bridge_or_torch(tmp_path):
    log = tmp_path / "job.log"
    log.write_text("[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.\n")
    code = ("import sys; from mbmem_overlays.cli import main;"
            "main(['list']); main(['explain','lora_regather']); main(['doctor', sys.argv[1]]);"
            "main(['slurm','--recipe','llama3_8b_pretrain','--overlay','expandable_segments','--nodes','1',"
            "'--gpus-per-node','8','--no-validate']);"
            "print('LEAK' if any(m.startswith(('megatron','torch')) for m in sys.modules) else 'CLEAN')")
    out = subprocess.run([sys.executable, "-c", code, str(log)], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("CLEAN"), out.stdout[-500:]


# ----------------------------------------------------------------------------- declared reads are complete
class RecordingView(View):
    """A View that remembers every config path and environment variable a check looks at."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen: set[str] = set()
        view = self

        class Env(dict):
            def get(self, key, default=None):
                view.seen.add(f"${key}")
                return super().get(key, default)

            def __getitem__(self, key):
                view.seen.add(f"${key}")
                return super().__getitem__(key)

            def __contains__(self, key):
                view.seen.add(f"${key}")
                return super().__contains__(key)

        self.env = Env(self.env)

    def get(self, path, default=None):
        self.seen.add(path)
        return super().get(path, default)


STATES = {  # recipe, fields: prospective states that walk every check's branches
    "dense offload": ("llama3_8b_pretrain_config", {"model.cpu_offloading": True, "model.cpu_offloading_num_layers": 0,
                                                    "model.cpu_offloading_weights": True,
                                                    "optimizer.optimizer_cpu_offload": True,
                                                    "optimizer.optimizer_offload_fraction": 0.0}),
    "full recompute + graphs": ("llama3_8b_pretrain_config", {
        "model.recompute_granularity": "full", "model.recompute_num_layers": 99, "model.cuda_graph_impl": "local",
        "model.pipeline_model_parallel_size": 4, "model.virtual_pipeline_model_parallel_size": 3,
        "ddp.nccl_ub": True, "model.sequence_parallel": True, "model.distribute_saved_activations": True}),
    "selective everything": ("qwen3_30b_a3b_pretrain_config", {
        "model.recompute_granularity": "selective", "mixed_precision": "bf16_with_fp8_delayed_scaling_mixed",
        "model.recompute_modules": ["core_attn", "mlp", "moe", "moe_act", "layernorm", "mla_up_proj",
                                    "gdn_norm_out", "shared_experts"],
        "comm_overlap.overlap_moe_expert_parallel_comm": True, "model.moe_grouped_gemm": False}),
    "lora regather": ("llama3_8b_peft_config", {"peft.sequence_parallel_input_regather": True,
                                                "model.tensor_model_parallel_size": 2, "model.sequence_parallel": True,
                                                "optimizer.use_precision_aware_optimizer": True,
                                                "optimizer.use_distributed_optimizer": False}),
}


@pytest.mark.bridge
@pytest.mark.parametrize("state", sorted(STATES))
def test_checks_read_only_what_they_declare(recipe, state):
    from mbmem_overlays.core.paths import write
    name, fields = STATES[state]
    cfg = recipe(name)
    for path, value in fields.items():
        write(cfg, path, value)
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    selected = ("selective_recompute", "dist_optimizer", "lora_sp_regather")
    undeclared = {}
    for c in rules.CHECKS:
        view = RecordingView(cfg, {}, env, 1, selected, {"lora_sp_regather": {"strict": True}})
        list(c(view))
        extra = view.seen - set(c.reads)
        if extra:
            undeclared[c.id] = sorted(extra)
    assert not undeclared, f"checks read fields they do not declare in reads=(...): {undeclared}"
