"""What the Python conformance scripts share: named checks that report and never stop the run.

`@check("name")` runs the function at once and prints `ok` (with what it returned, if
anything) or `FAIL` with the reason and a short traceback; `finish()` prints the tally and
exits with the number of failures, so that `run.sh` sees any failure in the exit status.
"""
import sys
import traceback

failures = []


def check(name):
    def run(f):
        try:
            detail = f()
            print(f"ok   {name}" + (f": {detail}" if detail else ""))
        except Exception as e:  # noqa: BLE001 - every failure is reported, none stops the suite
            failures.append(name)
            print(f"FAIL {name}: {type(e).__name__}: {e}")
            traceback.print_exc(limit=3)
        return f

    return run


def finish():
    print(f"{len(failures)} failed" if failures else "all passed")
    sys.exit(len(failures))
