"""The paired overhead run's plumbing: CPU sets as Linux writes them, and what
each side's own run is given (everything but the pairing, repeats and output)."""

from benchmarks.router.overhead import child_args, parse_cpus


def test_cpu_sets_parse_ranges_and_lists():
    assert parse_cpus("0-6") == set(range(7))
    assert parse_cpus("3") == {3}
    assert parse_cpus("0-1,8,10-11") == {0, 1, 8, 10, 11}


def test_each_side_gets_the_workload_but_not_the_pairing():
    argv = ["--compare", ".baseline", "--rates", "500", "--paired", "0-6:8-14", "--repeats=4",
            "--output-tokens", "1", "64", "--out", "x.json", "--duration", "5"]
    assert child_args(argv) == ["--compare", ".baseline", "--rates", "500",
                                "--output-tokens", "1", "64", "--duration", "5"]
