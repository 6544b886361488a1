"""`sweep.repeats=N` on a `-m` command line: each configuration runs N times, interleaved.

Hydra's basic sweeper runs the product of the swept values with the last override varying
fastest, so `sweep.repeat=0,1,...,N-1` placed before every other override makes the order
A B C A B C: a noisy neighbour, thermal drift or a slow period then hits every configuration
alike instead of all repeats of one. Each job records its `sweep.repeat`; the report groups
the jobs by their overrides without it (framework/report/repeats.py).
"""

from __future__ import annotations

from framework.config import ConfigError

MULTIRUN = ("-m", "--multirun")


def expand(argv: list[str]) -> list[str]:
    """The command line with `sweep.repeat=0,...,N-1` inserted before the first override;
    unchanged without `sweep.repeats` (or with 1). ConfigError: repeats outside a sweep, or
    a repeat index given by hand beside repeats."""
    given = [a for a in argv if a.split("=", 1)[0].lstrip("+") == "sweep.repeats"]
    if not given:
        return argv
    value = given[-1].split("=", 1)[1]
    try:
        n = int(value)
    except ValueError:
        return argv  # the schema says what is wrong with it
    if n <= 1:
        return argv
    if not any(a in MULTIRUN for a in argv):
        raise ConfigError("sweep.repeats", n, "repeats the jobs of a sweep, and this is a single run",
                          f"add -m (python run.py -m <overrides> sweep.repeats={n}), or drop sweep.repeats")
    if any(a.startswith("hparams_search=") and a != "hparams_search=null" for a in argv):
        raise ConfigError("sweep.repeats", n, "repeats the jobs of a basic sweep (-m over listed values); a layout "
                          "search's sampler would take the repeat index for a parameter to search",
                          "drop sweep.repeats from the search, or repeat its best layouts in a basic sweep")
    if any(a.split("=", 1)[0].lstrip("+") == "sweep.repeat" for a in argv):
        raise ConfigError("sweep.repeat", "given", "is set by sweep.repeats (each job's repeat index)",
                          "drop sweep.repeat from the command line")
    first = next((i for i, a in enumerate(argv) if "=" in a and not a.startswith("-")), len(argv))
    return argv[:first] + [f"sweep.repeat={','.join(map(str, range(n)))}"] + argv[first:]
