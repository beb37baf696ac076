import pytest

from common.errors import CaptureError
from capture.targets import PRESETS, make_taps, parse_layers, resolve_target


def test_presets_have_the_published_shapes():
    glm = PRESETS["glm-5.3"]
    assert (glm.num_layers, glm.hidden_size, glm.default_taps, glm.default_final) == (78, 6144, (5, 19, 33, 47, 61, 75), "none")
    flash = PRESETS["glm-5.3-flash"]
    assert (flash.num_layers, flash.hidden_size, flash.default_taps, flash.default_final) == (45, 4096, (5, 14, 24, 33, 42), "post-norm")
    smol = PRESETS["smollm2-135m"]
    assert (smol.num_layers, smol.hidden_size) == (30, 576)


def test_taps_sorted_and_columns():
    taps = make_taps(PRESETS["smollm2-135m"], (27, 3, 15), "post-norm")
    assert taps.layers == (3, 15, 27)
    assert taps.columns == ("tap_3", "tap_15", "tap_27", "final")
    assert make_taps(PRESETS["glm-5.3"], None, None).columns == tuple(f"tap_{k}" for k in (5, 19, 33, 47, 61, 75))


@pytest.mark.parametrize(
    "layers, final, message",
    [
        ((3, 30), "none", "out of range"),
        ((-1,), "none", "out of range"),
        ((78,), "none", "out of range"),
        ((3, 3), "none", "duplicate tap"),
        ((29,), "pre-norm", "duplicates tap 29"),
        ((), "none", "nothing to capture"),
    ],
)
def test_bad_taps_are_one_clear_error(layers, final, message):
    target = PRESETS["glm-5.3"] if layers == (78,) else PRESETS["smollm2-135m"]
    with pytest.raises(CaptureError, match=message):
        make_taps(target, layers, final)


def test_pre_norm_without_last_tap_and_layer_parse():
    assert make_taps(PRESETS["smollm2-135m"], (3, 28), "pre-norm").columns == ("tap_3", "tap_28", "final")
    assert parse_layers("5, 19,33") == (5, 19, 33)
    with pytest.raises(CaptureError, match="comma-separated integers"):
        parse_layers("5,x")
    for text in ("", " ", "3,,15", "3,15,"):  # were read as the preset's taps / 3,15
        with pytest.raises(CaptureError, match="comma-separated integers"):
            parse_layers(text)
    assert parse_layers(None) is None and parse_layers([3, 15]) == (3, 15)


def test_local_model_folder(smol_dir):
    t = resolve_target(str(smol_dir))
    assert (t.num_layers, t.hidden_size, t.architecture) == (30, 576, "llama")
    assert all(0 <= k < 30 for k in t.default_taps)
    with pytest.raises(CaptureError, match="unknown target"):
        resolve_target("no/such-model")


def test_preset_weights_come_from_local_disk_only(smol_dir, tmp_path, monkeypatch):
    from capture.targets import model_dir

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(CaptureError, match="zai-org/GLM-5.3 is not on this machine"):
        model_dir(PRESETS["glm-5.3"])
    with pytest.raises(CaptureError, match="has 30 layers / hidden 576, but glm-5.3 has 78 / 6144"):
        model_dir(PRESETS["glm-5.3"], str(smol_dir))
    assert model_dir(PRESETS["smollm2-135m"], str(smol_dir)) == smol_dir
