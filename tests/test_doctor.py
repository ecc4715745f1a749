"""`make doctor` on this machine: every claimed native path passes; one that breaks makes it exit 1."""

import bench.numerics.plan
import bench.numerics.precision
import bench.tools.doctor


def _rows(out: str) -> dict[str, list[str]]:
    """The doctor's precision table: setting -> [path here, step, detail]."""
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] not in ("setting", "") and not set(cells[0]) <= set("-: "):
            rows[cells[0]] = cells[1:]
    return rows


def test_doctor_reports_every_setting_as_the_device_claims_it_and_passes_here(capsys):
    """Each row against what the device itself claims (specs.native_support): a claimed native path is stepped and
    passes with its step time; an unclaimed one is emulated, not stepped, with the device's reason; FP32 is IEEE."""
    import torch

    from bench.numerics import specs
    from bench.tools.matrix import settings

    assert bench.tools.doctor.main() == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    path, step, detail = rows.pop("32-true (TF32 off)")
    assert (path, step) == ("native", "pass") and float(detail.rsplit(" ", 1)[1]) < 1e-5
    for fmt, mode in settings():
        if fmt == "fp32":
            continue
        path, step, detail = rows.pop(f"{fmt}-{mode}" if fmt in ("fp16", "bf16") else fmt)
        support = specs.native_support(fmt, torch.device("cpu"))
        if support.available:
            assert path == ("native" if support.fast else "native (slow; auto emulates)") and step == "pass"
            assert "ms a step" in detail and support.why in detail, (fmt, mode, detail)
        else:
            assert (path, step, detail) == ("emulated", "–", support.why)
    assert rows == {}  # no row the device matrix does not know
    assert "doctor: every native path this device claims works" in out
    assert "W&B:" in out and "raschka_distilbert_imdb" in out and "SLURM:" in out


def test_the_fp32_check_catches_a_matmul_that_rounds_its_inputs_to_tf32(monkeypatch):
    """fp32_is_ieee is the proof that 32-true is not secretly TF32: a matmul whose inputs keep 10 mantissa bits (the
    low 13 of FP32's 23 cleared, by hand) fails it."""
    import torch

    matmul = torch.Tensor.__matmul__

    def tf32(t):  # the float64 reference product passes through as it is
        return (t.view(torch.int32) & ~0x1FFF).view(torch.float32) if t.dtype == torch.float32 else t

    assert bench.tools.doctor.fp32_is_ieee(torch.device("cpu"))[0]
    monkeypatch.setattr(torch.Tensor, "__matmul__", lambda a, b: matmul(tf32(a), tf32(b)))
    ok, detail = bench.tools.doctor.fp32_is_ieee(torch.device("cpu"))
    assert not ok and float(detail.rsplit(" ", 1)[1]) > 1e-4


def test_a_native_path_that_breaks_makes_the_doctor_fail(capsys, monkeypatch):
    native = bench.numerics.plan.native_support

    def claimed(fmt, device):
        return bench.tools.doctor.hardware.NativeSupport(True, True, "claimed for the test") if fmt == "bf16" \
            else native(fmt, device)

    monkeypatch.setattr(bench.tools.doctor.specs, "native_support", claimed)  # what doctor lists
    monkeypatch.setattr(bench.numerics.plan, "native_support", claimed)  # what the plan decides
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
