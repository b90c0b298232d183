"""studies/judge_cost.py: the parameter counts docs/judge.md states, and the image tokens."""

from studies import judge_cost
from test_recast import refused


def test_parameter_counts_of_the_models_that_fit():
    n3, n7 = (judge_cost.parameters(name) for name in judge_cost.CONFIGS)
    assert n3["total"] == 3_754_622_976 and n3["head"] == 0  # tied output layer: 7.5 GB in bf16
    assert n7["total"] == 8_292_166_656  # 16.6 GB in bf16
    assert n3["vision"] + n3["embed"] + n3["body"] == n3["total"]


def test_image_patches_follow_qwen2_vl_resizing():
    assert judge_cost.image_patches(512) == 36 * 36  # 504 px a side
    assert judge_cost.image_patches(64) == 4 * 4  # 56 px, as the tiny model's tests see it
    assert judge_cost.image_patches(1024) == 74 * 74  # 1036 px


def test_a_size_or_rate_out_of_range_exits_2_naming_it(capsys):
    """--size 0 printed a table of meaningless numbers with exit 0; --tflops 0 ended in a
    ZeroDivisionError traceback after the first model was built. One line, exit 2, no table."""
    cases = {
        "--size 0": "--size: must be 56 to 3584 px",
        "--size 4000": "--size: must be 56 to 3584 px",
        "--tflops 0": "--tflops: must be > 0 and finite, got 0.0",
        "--tflops inf": "--tflops: must be > 0 and finite, got inf",
        "--size x": "--size: invalid int value",
    }
    for argv, said in cases.items():
        refused(capsys, judge_cost.main, argv.split(), f"judge_cost.py: error: {said}")
