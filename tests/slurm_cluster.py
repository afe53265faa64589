"""A real one-node Slurm on localhost for tests (facts: shared/reference/slurm-and-launch.md).

Starts munged, slurmctld and slurmd as root in a private folder and stops them by pid.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")


def available() -> str | None:
    """None when a cluster can be started here, else the reason."""
    if os.geteuid() != 0:
        return "needs root (slurmd and munged run as root)"
    for tool in ("slurmctld", "slurmd", "sbatch", "munged", "mungekey"):
        if not shutil.which(tool):
            return f"{tool} not installed (apt-get install {' '.join(PACKAGES)})"
    return None


class Cluster:
    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.pidfiles = [root / "slurmd.pid", root / "slurmctld.pid", root / "munged.pid"]
        # Each pytest-xdist worker (`make test` runs two) starts its own cluster: its own pair of ports.
        worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
        offset = 2 * int(worker) if worker.isdigit() and len(worker) < 4 else 0
        self.ports = (6817 + offset, 6818 + offset)

    def start(self) -> None:
        r = self.root
        for d in ("munge", "spool", "state"):
            (r / d).mkdir(parents=True, exist_ok=True)
        os.chmod(r, 0o755)
        os.chmod(r / "munge", 0o755)  # munged refuses a socket folder that is not world-executable
        key, sock = r / "munge.key", r / "munge" / "munge.socket"
        subprocess.run(["mungekey", "-c", "-f", "-k", str(key)], check=True, capture_output=True)
        os.chmod(key, 0o600)
        subprocess.run(["munged", f"--key-file={key}", f"--socket={sock}", f"--pid-file={r / 'munged.pid'}",
                        f"--log-file={r / 'munged.log'}", f"--seed-file={r / 'munged.seed'}", "--force"],
                       check=True, capture_output=True)
        host = socket.gethostname()
        node = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout.splitlines()[0]
        node = " ".join(p for p in node.split() if not p.startswith("UpTime")) + " NodeAddr=127.0.0.1"
        self.conf.write_text("\n".join([
            "ClusterName=mbmem", f"SlurmctldHost={host}(127.0.0.1)", "SlurmUser=root", "SlurmdUser=root",
            f"SlurmctldPort={self.ports[0]}", f"SlurmdPort={self.ports[1]}", "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={sock}", f"StateSaveLocation={r / 'state'}", f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}", f"SlurmdPidFile={r / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'slurmctld.log'}", f"SlurmdLogFile={r / 'slurmd.log'}", "MailProg=/bin/true",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "MpiDefault=none", "SchedulerType=sched/backfill",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "ReturnToService=2", "MinJobAge=300",
            node, f"PartitionName=debug Nodes={host} Default=YES State=UP MaxTime=INFINITE", ""]))
        subprocess.run(["slurmctld", "-f", str(self.conf)], check=True, env=self.env, capture_output=True)
        subprocess.run(["slurmd", "-f", str(self.conf)], check=True, env=self.env, capture_output=True)
        deadline = time.time() + 30
        while time.time() < deadline:
            out = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, env=self.env)
            if out.returncode == 0 and out.stdout.strip() in ("idle", "mix", "alloc"):
                return
            time.sleep(0.3)
        raise RuntimeError(f"slurm did not come up: {out.stdout} {out.stderr} "
                           f"{(r / 'slurmctld.log').read_text()[-2000:] if (r / 'slurmctld.log').exists() else ''}")

    def submit(self, script: Path, workdir: Path, output: str | None = "slurm-%j.out") -> int:
        """sbatch the script from ``workdir``; ``output=None`` keeps the script's own #SBATCH --output."""
        log = [f"--output={workdir}/{output}"] if output else []
        out = subprocess.run(["sbatch", "--parsable", f"--chdir={workdir}", *log, str(script)],
                             capture_output=True, text=True, env=self.env, check=True)
        return int(out.stdout.strip().split(";")[0])

    def wait(self, job: int, timeout: float = 600) -> str:
        deadline = time.time() + timeout
        while time.time() < deadline:
            out = subprocess.run(["scontrol", "show", "job", str(job)], capture_output=True, text=True, env=self.env)
            state = next((w.split("=", 1)[1] for w in out.stdout.split() if w.startswith("JobState=")), "")
            if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
                return state
            time.sleep(0.3)
        raise TimeoutError(f"job {job} did not finish in {timeout}s")

    def stop(self) -> None:
        for pidfile in self.pidfiles:  # by pid, never by name
            try:
                os.kill(int(pidfile.read_text().strip()), signal.SIGTERM)
            except (OSError, ValueError):
                pass
