"""`gradsum bench train`'s table: ratios to the first row, and the plan each scheduler chose."""

from gradsum.bench.train import TrainRow, format_table


def _row(scheduler: str, samples_per_s: float, plan: str = "") -> TrainRow:
    return TrainRow(
        method=f"ps:none/{scheduler}",
        aggregator="ps",
        codec="none",
        scheduler=scheduler,
        model="alexnet",
        workers=4,
        epochs=1,
        samples_per_s=samples_per_s,
        test_accuracy=0.5,
        train_seconds=10.0,
        plan=plan,
    )


def test_rows_show_their_ratio_to_the_first_and_the_plan_each_ran():
    rows = [_row("default", 20.0, "plan default: 8 groups"), _row("imerge", 25.0, "plan imerge")]
    lines = format_table(rows).splitlines()
    assert lines[2].split()[-2:] == ["1.00x", "0.5000"]
    assert lines[3].split()[-2:] == ["1.25x", "0.5000"]
    assert lines[4:] == [
        "plans:",
        "  ps:none/default: plan default: 8 groups",
        "  ps:none/imerge: plan imerge",
    ]


def test_rows_without_a_plan_print_no_plan_section():
    assert "plans:" not in format_table([_row("wfbp", 20.0)])
