#!/usr/bin/env python3
"""What `mlx.launch --backend jaccl` gives each rank, for the engine-group tests: mlx.launch's
own `launch_jaccl` runs on each hostfile read from stdin, with the step that would start the
ranks replaced by one that records them, so nothing is started.

    .venv/bin/python scripts/mlx_launch_jaccl_env.py <coordinator port> < cases.json

stdin holds a JSON list of hostfiles (each a list of host entries, as in mlx.launch's
`--hostfile`). stdout holds one JSON list, an entry per hostfile: `{"error": "..."}` where
mlx.launch refuses it, else `{"ranks": [{"rank", "host", "env": {...}, "files": {...}}]}`:
the variables each rank is given (`MLX_RANK` included, which mlx.launch's launch script
exports) and the files it writes for it, by the variable that names each.
"""
import argparse
import json
import sys

from mlx._distributed_utils import launch
from mlx._distributed_utils.common import Host


class Refused(Exception):
    pass


class Parser(argparse.ArgumentParser):
    """mlx.launch's argument parser, whose `error` raises instead of exiting."""

    def error(self, message):
        raise Refused(message)


def ranks_of(hosts, port):
    started = []

    def record(_command_class, arguments, _verbose):
        for (rank, host, python, cwd, files, env, command), _kwargs in arguments:
            script = launch.RemoteProcess.make_launch_script(
                rank, python, cwd, files, env, command, True
            )
            # The launch script exports the rank after the environment and the files.
            assert f"export MLX_RANK={rank};" in script, script
            variables = dict(e.split("=", 1) for e in env)
            variables["MLX_RANK"] = str(rank)
            started.append(
                {"rank": rank, "host": host, "env": variables, "files": dict(files)}
            )

    launch._launch_with_io = record
    args = argparse.Namespace(
        backend="jaccl", starting_port=port, env=[], cwd=None, verbose=False, python=None
    )
    launch.launch_jaccl(Parser(prog="mlx.launch"), hosts, args, ["true"])
    return started


def main():
    port = int(sys.argv[1])
    answers = []
    for entries in json.load(sys.stdin):
        hosts = [
            Host(i, h["ssh"], h.get("ips", []), h.get("rdma", []))
            for i, h in enumerate(entries)
        ]
        try:
            answers.append({"ranks": ranks_of(hosts, port)})
        except Refused as e:
            answers.append({"error": str(e)})
    json.dump(answers, sys.stdout)


if __name__ == "__main__":
    main()
