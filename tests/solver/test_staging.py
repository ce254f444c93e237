"""Nothing lost (issue 38 items 7-9, 16): a command's outputs are written all together or none, never over an
existing file without --force, never two on one path; launch scripts are executable."""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from graphs import FitplanError
from solver.cli.app import app
from solver.plan.staging import refuse_shared_paths, text_writer, write_together

SOLVE = ["solve", "--model", "gpt2", "--gpus", "1xA100", "--seq-len", "512", "--global-batch", "8", "--time-limit", "5",
         "--json"]


def invoke(args: list[object]):
    return CliRunner().invoke(app, [str(arg) for arg in args])


def files_under(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_full_disk_during_emit_writes_nothing_and_the_rerun_succeeds(tmp_path, monkeypatch):
    folder, plan_path = tmp_path / "out", tmp_path / "plan.json"
    args = [*SOLVE, "-o", plan_path, "--emit", "torchrun", "--emit-dir", folder]
    real = Path.write_text

    def full_disk(self, text, *rest, **options):
        if "launch" in self.name:  # the disk fills while the launcher is written, after the plan
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real(self, text, *rest, **options)

    monkeypatch.setattr(Path, "write_text", full_disk)
    result = invoke(args)
    assert result.exit_code == 2, result.output
    assert "nothing was written" in " ".join(result.stderr.split())
    assert os.listdir(tmp_path) == []  # no plan.json, no empty launcher, no temporary, no emit folder
    monkeypatch.setattr(Path, "write_text", real)
    rerun = invoke(args)
    assert rerun.exit_code == 0, rerun.output
    assert set(files_under(folder)) == {"plan.json", "train_fitplan.py", "torchrun_launch.sh"}
    assert json.loads(plan_path.read_text())["decisions"] == json.loads(rerun.stdout)["decisions"]


def test_launch_scripts_are_executable_and_other_files_are_not(tmp_path):
    folder = tmp_path / "out"
    result = invoke([*SOLVE, "--emit", "torchrun", "--emit-dir", folder])
    assert result.exit_code == 0, result.output
    umask = os.umask(0)
    os.umask(umask)
    for name in ("torchrun_launch.sh", "train_fitplan.py", "plan.json"):
        mode = stat.S_IMODE((folder / name).stat().st_mode)
        executable = 0o777 & ~umask if name.endswith(".sh") else 0o666 & ~umask  # as a shell's > and chmod +x
        assert mode == executable, (name, oct(mode))


@pytest.mark.parametrize("outputs", [
    ["-o", "{t}/same.png", "--plot", "{t}/same.png"],
    ["-o", "{t}/eo/ds_config.json", "--emit", "deepspeed", "--emit-dir", "{t}/eo"],
    ["-o", "{t}/link.json", "--plot", "{t}/target.png"],  # link.json -> target.png
    ["-o", "{t}/eo/../eo/torchrun_launch.sh", "--emit", "torchrun", "--emit-dir", "{t}/eo"],
])
def test_two_outputs_on_one_path_are_refused_and_nothing_is_written(outputs, tmp_path):
    (tmp_path / "eo").mkdir()
    (tmp_path / "link.json").symlink_to(tmp_path / "target.png")
    before = files_under(tmp_path)
    result = invoke([*SOLVE, *[part.replace("{t}", str(tmp_path)) for part in outputs]])
    assert result.exit_code == 2, result.output
    assert "both write" in " ".join(result.stderr.split())
    assert files_under(tmp_path) == before and sorted(os.listdir(tmp_path / "eo")) == []


def test_choose_plot_and_measure_output_refuse_an_existing_file_before_working(tmp_path, monkeypatch):
    existing = tmp_path / "kept.png"
    existing.write_text("mine")
    import solver.choose
    import solver.hardware.measure

    def never(*args, **kwargs):
        raise AssertionError("refused only after the work")

    monkeypatch.setattr(solver.choose, "solve_sweep", never)
    monkeypatch.setattr(solver.hardware.measure, "measure", never)
    for args in (["choose", "--model", "gpt2", "--tokens", "2e9", "--plot", existing],
                 ["measure", "--device", "cpu", "-o", existing]):
        result = invoke(args)
        assert result.exit_code == 2, result.output
        assert "--force" in " ".join(result.stderr.split())
        assert existing.read_text() == "mine"


def test_measure_force_replaces_the_output(tmp_path, monkeypatch):
    import solver.hardware.measure as measure

    existing = tmp_path / "profile.json"
    existing.write_text("old")
    monkeypatch.setattr(measure, "measure", lambda *a, **k: "PROFILE")
    monkeypatch.setattr("costmodels.profile.profile_json", lambda profile: f'{{"p": "{profile}"}}')
    _, path = measure.measure_to_file("cpu", quick=True, ranks=1, output=existing, force=True)
    assert path == existing and json.loads(existing.read_text()) == {"p": "PROFILE"}


def test_write_together_writes_all_or_none(tmp_path):
    first, second = tmp_path / "a.json", tmp_path / "b.sh"

    def broken(path: Path) -> None:
        raise RuntimeError("matplotlib missing")

    with pytest.raises(RuntimeError):
        write_together({first: text_writer("a"), second: broken}, force=False)
    assert os.listdir(tmp_path) == []
    assert write_together({first: text_writer("a"), second: text_writer("b")}, force=False) == [first, second]
    with pytest.raises(FitplanError, match="overwrite"):
        write_together({first: text_writer("new")}, force=False)
    assert first.read_text() == "a"


def test_shared_paths_named_by_both_options(tmp_path):
    (tmp_path / "x").write_text("")
    os.link(tmp_path / "x", tmp_path / "hard")
    with pytest.raises(FitplanError, match="-o and --plot both write"):
        refuse_shared_paths({"-o": tmp_path / "x", "--plot": tmp_path / "hard"})
    refuse_shared_paths({"-o": tmp_path / "x", "--plot": tmp_path / "y"})


def test_every_output_flag_of_every_command_on_one_existing_path_loses_nothing(tmp_path):
    """The issue's closing check: every command, every output flag pointing at one path."""
    path = tmp_path / "one"
    path.write_text("kept")
    runs = [[*SOLVE, "-o", path], [*SOLVE, "--plot", path], [*SOLVE, "-o", path, "--plot", path],
            [*SOLVE, "--emit", "torchrun", "--emit-dir", path],
            [*SOLVE, "-o", path, "--plot", path, "--emit", "torchrun", "--emit-dir", path],
            ["choose", "--model", "gpt2", "--tokens", "2e9", "--plot", path], ["measure", "-o", path]]
    for args in runs:
        result = invoke(args)
        assert result.exit_code == 2, (args, result.output)
        assert os.listdir(tmp_path) == ["one"] and path.read_text() == "kept", args
