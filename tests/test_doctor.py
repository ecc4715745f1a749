"""`make doctor` on this machine: every claimed native path passes; one that breaks makes it exit 1."""

import bench.numerics.precision
import bench.tools.doctor


def test_doctor_reports_every_setting_and_passes_here(capsys):
    assert bench.tools.doctor.main() == 0
    out = capsys.readouterr().out
    assert "| 32-true (TF32 off) | native" in out and "pass" in out
    for setting in ("tf32", "fp16-mixed", "fp16-true", "bf16-mixed", "bf16-true", "fp8"):
        assert f"| {setting} " in out
    assert "W&B:" in out and "raschka_distilbert_imdb" in out and "SLURM:" in out


def test_a_native_path_that_breaks_makes_the_doctor_fail(capsys, monkeypatch):
    native = bench.numerics.precision.native_support
    monkeypatch.setattr(bench.tools.doctor.specs, "native_support", lambda fmt, device: bench.tools.doctor.hardware.NativeSupport(
        True, True, "claimed for the test") if fmt == "bf16" else native(fmt, device))
    prepare = bench.numerics.precision.Precision.prepare

    def broken(self, model):
        if self.format == "bf16":
            raise RuntimeError("no kernel for bf16 here")
        return prepare(self, model)

    monkeypatch.setattr(bench.numerics.precision.Precision, "prepare", broken)
    assert bench.tools.doctor.main() == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "no kernel for bf16 here" in out and "a native path FAILED" in out


def test_the_char_lm_presets_say_whether_their_text_is_downloaded_yet(tmp_path, monkeypatch):
    from bench.tools.doctor import preset_rows

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    rows = dict(preset_rows())
    assert rows["nanogpt_shakespeare_char_cpu"].startswith("not cached: downloads https://")
    (tmp_path / "precision-bench").mkdir()
    (tmp_path / "precision-bench" / "input.txt").write_text("text")
    assert dict(preset_rows())["unit_scaling_charlm"].startswith("cached: ")
    assert rows["smoke"] == "nothing to download"
