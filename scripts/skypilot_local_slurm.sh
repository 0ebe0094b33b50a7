#!/usr/bin/env bash
# A SkyPilot managed job through a kill, with a one-node Slurm on localhost as SkyPilot's "cloud".
#
#   sudo bash scripts/skypilot_local_slurm.sh        # opt-in: minutes, root, installs and starts daemons
#
# Not in CI, and UNVERIFIED: written on a machine with no slurmd to run it on (docs/targets.md, "What
# is unverified"). It installs Debian's slurm-wlm, munge and openssh-server, starts slurmctld, slurmd
# and an sshd on 127.0.0.1:2222, points SkyPilot's ~/.slurm/config at them, smokes the example job for
# target skypilot, launches it as a managed job (`sky jobs launch`), cancels the Slurm allocation of
# its cluster once a checkpoint is in the state folder (a preemption: the machine goes, no exit code),
# waits for SkyPilot to recover the job and finish it, and compares the recovered run's trace with an
# uninterrupted run's, value for value. The bucket is a local folder here (one machine: every "node"
# sees it), so the task's file_mounts are dropped; the bucket mounts themselves stay unverified.
# Needs: root, Debian/Ubuntu, kchain's venv (.venv), and `sky` on PATH (pipx install skypilot==0.14.1).
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PY:-$REPO/.venv/bin/python}"
KCHAIN="${KCHAIN:-$REPO/.venv/bin/kchain}"
WORK="${WORK:-$(mktemp -d /tmp/kchain-sky-slurm-XXXX)}"
NAME=tinygpt-notes
MANAGED=kchain-kill-check
say() { echo "[skypilot-local-slurm] $*"; }

[ "$(id -u)" = 0 ] || { say "run it as root: it installs and starts slurmctld, slurmd, munged and sshd"; exit 2; }
command -v sky >/dev/null || { say "needs SkyPilot on PATH: pipx install skypilot==0.14.1"; exit 2; }

# 1. A one-node Slurm on localhost (no cgroups: a container has none to give).
apt-get install -y -q slurm-wlm munge openssh-server >/dev/null
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge
MEM_MB=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 2048 ))
cat > /etc/slurm/slurm.conf <<EOF
ClusterName=kchain-local
SlurmctldHost=localhost
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ReturnToService=2
JobRequeue=1
NodeName=localhost CPUs=$(nproc) RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
[ -s /etc/munge/munge.key ] || { command -v mungekey >/dev/null && mungekey --create || /usr/sbin/create-munge-key -f; }
chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
pgrep -x munged >/dev/null || sudo -u munge /usr/sbin/munged
pgrep -x slurmctld >/dev/null || slurmctld
pgrep -x slurmd >/dev/null || slurmd
sleep 3 && sinfo

# 2. SkyPilot reaches the "login node" over SSH: an sshd on 127.0.0.1:2222 with a key of its own.
mkdir -p /run/sshd ~/.ssh ~/.slurm && chmod 700 ~/.ssh
[ -f "$WORK/id" ] || ssh-keygen -q -t ed25519 -N '' -f "$WORK/id"
grep -qF "$(cat "$WORK/id.pub")" ~/.ssh/authorized_keys 2>/dev/null || cat "$WORK/id.pub" >> ~/.ssh/authorized_keys
pgrep -f "sshd -p 2222" >/dev/null || /usr/sbin/sshd -p 2222 -o ListenAddress=127.0.0.1 -o PermitRootLogin=yes
cat > ~/.slurm/config <<EOF
Host kchain-local
  HostName 127.0.0.1
  Port 2222
  User root
  IdentityFile $WORK/id
EOF
sky check slurm

# 3. The example job for target skypilot on that cluster, smoked here first (push's gate).
rm -rf "$WORK/job" && cp -r "$REPO/jobs/tinygpt" "$WORK/job" && rm -rf "$WORK/job/.kchain"
cat >> "$WORK/job/job.yaml" <<EOF
target: skypilot
skypilot: {infra: slurm/kchain-local, use_spot: false, bucket: {name: kchain-local-state}}
EOF
sed -i 's/^  steps: 2000 .*/  steps: 240/; s/^  n_notes: 20000 .*/  n_notes: 2000/; s/^  eval_every: 200/  eval_every: 80/' \
  "$WORK/job/job.yaml"
sed -i 's/^  checkpoint_every: 10m/  checkpoint_every: 40 steps/' "$WORK/job/job.yaml"
KCHAIN_HOME="$WORK/kchain-home" "$KCHAIN" smoke "$WORK/job/job.yaml" --target skypilot --quiet
KCHAIN_HOME="$WORK/kchain-home" "$KCHAIN" render "$WORK/job/job.yaml" -o "$WORK/folder" >/dev/null
# One machine: the state folder stands for the bucket; every run gets a fresh, empty root (a new VM).
"$PY" - "$WORK" "$NAME" <<'EOF'
import sys, yaml
work, name = sys.argv[1], sys.argv[2]
path = f"{work}/folder/task.yaml"
task = yaml.safe_load(open(path))
task.pop("file_mounts")
task["envs"]["KCHAIN_STATE_SINK"] = f"{work}/sink/{name}"
task["run"] = 'export KCHAIN_ROOT="${KCHAIN_ROOT:-' + f'{work}/nodes/$(date +%s%N)' + '}"\n' + task["run"]
yaml.safe_dump(task, open(path, "w"), sort_keys=False)
EOF

# 4. Launch, and take the machine away once a checkpoint is in the state folder.
(cd "$WORK/folder" && sky jobs launch --name "$MANAGED" --yes --detach-run task.yaml)
until [ -f "$WORK/sink/$NAME/latest" ]; do sleep 5; done
say "checkpoint published: $(cat "$WORK/sink/$NAME/latest"); cancelling the cluster's Slurm allocation"
# The cluster's allocation is the Slurm job running the task (not SkyPilot's jobs controller).
squeue -h -o "%i %j" | grep -v -i controller | awk '{print $1}' | xargs -r scancel

# 5. SkyPilot recovers the job (RECOVERING, then RUNNING) and it finishes.
while :; do
  line="$(sky jobs queue 2>/dev/null | grep " $MANAGED " || true)"
  case "$line" in
    *SUCCEEDED*) say "$line"; break ;;
    *FAILED*|*CANCELLED*) say "the managed job ended badly: $line"; exit 1 ;;
  esac
  sleep 10
done

# 6. The recovered run's trace against an uninterrupted run of the same script here.
LAST="$(ls -td "$WORK"/nodes/* | head -n1)"
(cd "$WORK/folder" && KCHAIN_ROOT="$WORK/reference" KCHAIN_STATE_SINK="$WORK/sink-ref/$NAME" KCHAIN_ACCELERATOR_CHECK=off \
  PATH="$(dirname "$PY"):$PATH" bash -c "$("$PY" -c "import yaml,sys; print(yaml.safe_load(open('task.yaml'))['run'])")")
"$PY" - "$WORK/reference" "$LAST" <<'EOF'
import sys
from pathlib import Path
from kchain.result.traces import compare_traces, read_trace
ref, got = (read_trace(Path(root) / "working" / "kchain" / "metrics.jsonl") for root in sys.argv[1:])
rows, first = compare_traces(ref, got)
print(f"{len(rows)} values compared; first difference: {first}")
sys.exit(0 if rows and first is None else 1)
EOF
say "PASS: recovered after the kill, trace identical (work folder: $WORK)"
