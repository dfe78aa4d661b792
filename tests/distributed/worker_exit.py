"""The workers' entry: run main(out_path, spec), then join the process group's threads before the interpreter exits
(left to the destructors, gloo can abort at exit under load: "terminate called without an active exception")."""

import sys


def run(main) -> None:
    try:
        code = main(sys.argv[1], sys.argv[2])
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.exit(code)
