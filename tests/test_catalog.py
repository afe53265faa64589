"""The catalogue and the commands that must not import Megatron Bridge."""

import subprocess
import sys
from pathlib import Path

import pytest

from mbmem_overlays import OverlayError
from mbmem_overlays.core.catalog import Catalog, builtin_overlay_dir
from mbmem_overlays.core import rules
from mbmem_overlays.core.rules.registry import ENFORCERS

from conftest import ROOT, mbmem

REQUIRED = {"expandable_segments", "lora_sp_regather", "selective_recompute", "cpu_offload", "dist_optimizer",
            "full_recompute", "optimizer_offload"}


def test_required_overlays_and_alias():
    cat = Catalog()
    assert REQUIRED <= set(cat.names())
    assert cat.resolve("lora_regather").name == "lora_sp_regather"


def test_every_overlay_is_a_hydra_option_of_group_mem():
    for path in (builtin_overlay_dir() / "mem").glob("*.yaml"):
        first = path.read_text().splitlines()[0]
        assert first == f"# @package mem.{path.stem}", path
        spec = Catalog().specs[path.stem]
        assert spec.sources, f"{path.stem} cites no source"
        assert spec.summary and spec.effect


def test_every_check_cites_a_source_and_an_enforcer():
    for c in rules.CHECKS:
        assert c.source and c.enforced_by in ENFORCERS, c.id
    assert len({c.id for c in rules.CHECKS}) == len(rules.CHECKS)


def test_recompute_labels_come_from_installed_megatron_core():
    labels = rules.recompute_labels()
    assert {"core_attn", "mlp", "moe_act", "mla_up_proj"} <= labels


def test_unknown_overlay_suggests_the_right_name():
    with pytest.raises(OverlayError) as exc:
        Catalog().resolve("lora_regathr")
    assert "Did you mean 'lora_regather'" in str(exc.value) and "+mem=lora_regather" in str(exc.value)


def _write(dirpath: Path, name: str, text: str) -> Path:
    (dirpath / "mem").mkdir(parents=True, exist_ok=True)
    p = dirpath / "mem" / f"{name}.yaml"
    p.write_text(text if text.startswith("# @package") else f"# @package mem.{name}\n{text}")  # Hydra's header
    return p


def test_user_overlay_dir_and_collision(tmp_path):
    _write(tmp_path, "tiny_mbs", "# @package mem.tiny_mbs\nmbs: 1\noverlay:\n  summary: x\n  set:\n    train.micro_batch_size: '@mbs'\n")
    assert "tiny_mbs" in Catalog([tmp_path]).names()
    _write(tmp_path, "cpu_offload", "overlay:\n  summary: mine\n")
    cat = Catalog([tmp_path])  # a clash refuses the user file, not the whole catalogue
    assert "tiny_mbs" in cat.names() and cat.specs["cpu_offload"].builtin
    with pytest.raises(OverlayError, match="already the built-in overlay"):
        cat.resolve("cpu_offload")


def test_user_overlay_alias_collision(tmp_path):
    _write(tmp_path, "lora_regather", "overlay:\n  summary: mine\n")
    with pytest.raises(OverlayError, match="already the built-in overlay"):
        Catalog([tmp_path]).resolve("lora_regather")


@pytest.mark.parametrize("text, fragment", [
    ("overlay: [unclosed\n", "not valid YAML"),
    ("just: a value\n", "no 'overlay:' mapping"),
    ("overlay:\n  sett: {}\n", "unknown key"),
    ("overlay:\n  set:\n    model.x: '@nope'\n", "unknown parameter @nope"),
    ("n: 1\noverlay:\n  params:\n    n: {type: complex}\n", "has type 'complex'"),
])
def test_malformed_user_overlay(tmp_path, text, fragment):
    _write(tmp_path, "bad", text)
    cat = Catalog([tmp_path])
    assert any(fragment in p.message for p in cat.problems)
    with pytest.raises(OverlayError, match=fragment):
        cat.resolve("bad")


def test_missing_overlay_dir(tmp_path):
    cat = Catalog([tmp_path / "nope"])
    assert any("does not exist" in p.message for p in cat.problems)
    with pytest.raises(OverlayError, match="does not exist"):
        cat.resolve("my_overlay")


def test_list_and_explain_do_not_import_bridge_or_torch():
    code = ("import sys; from mbmem_overlays.cli import main; main(['list']); main(['explain','lora_regather']);"
            "print('LEAK' if any(m.startswith(('megatron','torch')) for m in sys.modules) else 'CLEAN')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("CLEAN")
    assert "lora_sp_regather" in out.stdout and "4.731 GB" in out.stdout


def test_explain_unknown_overlay_exits_nonzero():
    from mbmem_overlays.core.report import EXIT_REJECTED, EXIT_USAGE
    out = mbmem("explain", "cpu_ofload")
    assert out.returncode in (EXIT_REJECTED, EXIT_USAGE)  # the CLI's exit-code policy decides which
    assert "Did you mean 'cpu_offload'" in out.stderr and "Traceback" not in out.stderr


def test_wheel_carries_the_repository_overlays_and_recipes(tmp_path):
    """Build the real wheel, install it elsewhere, and use it: overlays, recipe configs and the
    Slurm template come from inside the package, byte-identical to the one copy in the repository."""
    import zipfile
    uv = Path(sys.executable).with_name("uv")
    out = subprocess.run([str(uv), "build", "--wheel", "-q", "-o", str(tmp_path / "dist"), str(ROOT)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    wheel = next((tmp_path / "dist").glob("*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder in ("overlays", "recipes"):
        for f in (ROOT / folder).rglob("*"):
            if f.is_file():
                inside = f"mbmem_overlays/{f.relative_to(ROOT).as_posix()}"
                assert inside in names, inside
                assert zipfile.ZipFile(wheel).read(inside) == f.read_bytes()
    assert not (ROOT / "src" / "mbmem_overlays" / "overlays").exists()  # one copy, in the repository
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    code = ("import mbmem_overlays, mbmem_overlays.core.catalog as c, mbmem_overlays.launch.slurm as s;"
            "assert str(tmp) in mbmem_overlays.__file__;"
            "assert {'cpu_offload','lora_sp_regather'} <= set(c.Catalog().names());"
            "assert c.recipe_file('tiny_llama') and s.TEMPLATE.is_file(); print('OK')").replace(
        "tmp", repr(str(tmp_path / "site")))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                         env={**__import__("os").environ, "PYTHONPATH": str(tmp_path / "site")})
    assert run.stdout.strip() == "OK", run.stderr


def test_ints_parameters_take_a_number_a_list_or_a_declared_word():
    from mbmem_overlays.core.catalog import coerce_param
    ranks = Catalog().specs["memory_snapshot"].params["ranks"]
    assert coerce_param(ranks, 8) == ([8], None) and coerce_param(ranks, [0, 24]) == ([0, 24], None)
    assert coerce_param(ranks, "pipeline_ends") == ("pipeline_ends", None)
    for bad, why in ((["0"], "whole numbers"), ([True], "whole numbers"), ([-1], ">= 0"), ("first", "one of"),
                     (2.5, "a whole number or a list")):
        assert why in coerce_param(ranks, bad)[1], bad
