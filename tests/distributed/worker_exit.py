"""The workers' entry: run main(out_path, spec), then leave as every torchrun rank of the CLI does
(deepinfer.cli.leave_launch: streams flushed, os._exit with the code, no interpreter teardown)."""

import sys
import traceback


def run(main) -> None:
    from deepinfer.cli import leave_launch
    try:
        code = main(sys.argv[1], sys.argv[2])
    except BaseException:                  # noqa: BLE001  printed here: os._exit would swallow it
        traceback.print_exc()
        code = 1
    leave_launch(code)
