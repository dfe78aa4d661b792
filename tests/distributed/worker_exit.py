"""The workers' entry: run main(out_path, spec), then leave at once with its exit code. By then every collective is
done and rank 0 has written its file; the interpreter's teardown is skipped because gloo's threads, left to the
destructors (and even with the process group destroyed first), can abort the process at exit under load:
"terminate called without an active exception" (docs/results.md, sessions 37 and 38)."""

import os
import sys
import traceback


def run(main) -> None:
    try:
        code = main(sys.argv[1], sys.argv[2])
    except BaseException:                  # noqa: BLE001  printed here: os._exit would swallow it
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
