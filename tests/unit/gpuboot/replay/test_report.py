"""The plain-text tables the replay and the benchmarks print."""
from gpuboot.replay.report import format_table


def test_table_aligns_text_left_numbers_right_and_shows_missing_as_dash():
    rows = [{"policy": "gpuboot", "hours": 1234.5, "boots": 7, "wait": None},
            {"policy": "always-on", "hours": 0.25, "boots": 0, "wait": 3.0}]
    text = format_table(rows, [("policy", "policy"), ("hours", "node-h"), ("boots", "boots"), ("wait", "wait s")])
    header, rule, first, second = text.splitlines()
    assert header.split() == ["policy", "node-h", "boots", "wait", "s"]
    assert set(rule.replace(" ", "")) == {"-"}
    assert first.startswith("gpuboot ") and first.split()[1:] == ["1,234.5", "7", "-"]
    assert second.split()[1:] == ["0.25", "0", "3"]
    boots_end = header.index("boots") + len("boots")            # numbers are right-aligned under their header
    assert (first[boots_end - 1], second[boots_end - 1]) == ("7", "0")
