"""Every environment variable tfdist reads or sets, named once.

Launchers set the task's variables (`TF_CONFIG` and the ``TFDIST_*`` below) for each
process they start; strategies, callbacks and the main job read them. Nothing here
imports TensorFlow or any other tfdist module.
"""

TF_CONFIG = "TF_CONFIG"  # TF's cluster and task description (JSON)

# Set by every tfdist launcher, for each task.
TASK = "TFDIST_TASK"  # the task's name, e.g. worker-1
RESTART = "TFDIST_RESTART"  # how many times the whole job restarted (0: first start)
BACKUP_DIR = "TFDIST_BACKUP_DIR"  # where BackupAndRestore keeps its backup

# Set by multi-node launches (tfdist launch --nnodes).
NODE_RANK = "TFDIST_NODE_RANK"
NNODES = "TFDIST_NNODES"
LOCAL_RANK = "TFDIST_LOCAL_RANK"
TOKEN = "TFDIST_TOKEN"  # the rendezvous' shared secret (read by tfdist launch)

# Set by the parameter-server restart policy (one worker restarted alone).
CONTROL_DIR = "TFDIST_CONTROL_DIR"  # the chief asks for a worker's restart with a file here
# ... named ``<request>-<task>`` (its text: why); the launcher SIGKILLs the task, then:
RESTART_REQUEST = "restart"  # a frozen or hung worker: restarted alone
STOP_REQUEST = "stop"  # a frozen ps: the job fails, naming it
TASK_RESTART = "TFDIST_TASK_RESTART"  # how many times this one task restarted

# Set by the launcher of an elastic job (--min-workers): its membership service.
ELASTIC_ADDR = "TFDIST_ELASTIC_ADDR"  # HOST:PORT of the service (and of Gloo's rendezvous)

# Read by tfdist, set by the user or a job script.
ENGINE = "TFDIST_ENGINE"  # replaces engine="auto"'s choice for the whole job
SLURM_PORT = "TFDIST_SLURM_PORT"  # first port of a Slurm job's tasks
TEST_KILL_AFTER_EPOCH = "TFDIST_TEST_KILL_AFTER_EPOCH"  # tests: a task kills itself
