"""What the plots decide, apart from drawing: a marker per scaling method (plug-ins included), text that reads on
its cell, the time axis (a GPU's time to target, measured where the cell ran there), loss curves to the last step,
and identical loss-scale trajectories drawn once, naming every run on them."""

import matplotlib
import numpy as np
import pandas as pd
import pytest

from bench.numerics.scaling_methods import SCALING_METHODS
from bench.reporting import plots


def test_every_scaling_method_and_a_plug_in_get_distinct_markers():
    markers = plots.scaling_markers(["none", "my_hysteresis", "unit", "another"])
    assert len(set(markers.values())) == len(markers) == len(SCALING_METHODS) + 2
    assert markers["my_hysteresis"] != markers["none"]


@pytest.mark.parametrize("value,colour", [(0.0, "white"), (1.0, "black")])
def test_heatmap_text_is_black_on_light_cells_and_white_on_dark_ones(value, colour):
    """viridis runs from dark purple (0) to yellow (1): white text on the one, black on the other."""
    assert plots.text_colour(matplotlib.colormaps["viridis"](value)) == colour


def _cells(**columns):
    base = {"setting": ["32-true", "fp8-mixed"], "train_s": [5.0, 7.0], "train_s_min": [4.0, 6.0],
            "train_s_max": [6.0, 8.0], "steps_to_target": [100.0, 120.0], "steps_to_target_lo": [90.0, 100.0],
            "steps_to_target_hi": [110.0, 140.0], "step_median_s": [0.05, 0.07]}
    return pd.DataFrame(base | columns)


def test_the_time_axis_is_a_gpus_time_to_target_measured_where_the_cell_ran_there():
    cells = _cells(predicted_H100_to_target_s=[0.2, 0.18], predicted_H100_compiled_s=[0.002, 0.0015],
                   predicted_H100_error=[0.1, np.nan])  # the first ran natively on an H100: its own step
    time, below, above, quantity, label = plots.time_axis(cells)
    assert time.tolist() == pytest.approx([100 * 0.05, 120 * 0.0015])
    assert below.tolist() == pytest.approx([10 * 0.05, 20 * 0.0015])
    assert above.tolist() == pytest.approx([10 * 0.05, 20 * 0.0015])
    assert label.startswith("time to target on H100 (s), predicted by the speed model")
    assert quantity == "time to target"
    time, _, _, quantity, label = plots.time_axis(_cells())  # no prediction anywhere: this device's train time
    assert time.tolist() == [5.0, 7.0] and label.startswith("train time on this device")
    assert quantity == "train time"


def test_a_loss_curve_reaches_the_last_step_with_the_recorded_final_loss():
    run = pd.Series({"losses": [[0, 2.3], [20, 1.0]], "final_train_loss": 0.7, "steps": 30})
    assert plots.curve_points(run) == [(0, 2.3), (20, 1.0), (30, 0.7)]
    assert plots.curve_points(run.copy().replace({30: 20})) == [(0, 2.3), (20, 1.0)]


def test_identical_loss_scale_trajectories_are_one_line_naming_every_run():
    def run(setting, seed, history, scaling="dynamic"):
        return {"setting": setting, "scaling": scaling, "seed": seed, "steps": 50, "loss_scaling": "dynamic",
                "loss_scale_history": history}

    flat, dropped = [[0, 65536.0]], [[0, 65536.0], [10, 32768.0]]
    runs = pd.DataFrame([run("32-true", 0, flat), run("32-true", 1, flat), run("16-mixed", 0, dropped),
                         run("tf32", 0, flat)])
    groups = plots.trajectory_groups(runs)
    assert [label for _, label in groups] == ["dynamic: 32-true s0,1, tf32 s0", "dynamic: 16-mixed s0"]
    assert groups[1][0] == ((0, 10, 50), (65536.0, 32768.0, 32768.0))
