"""Where a run executes and how TensorFlow starts: the cluster a process is in (cluster.py:
TF_CONFIG or --cluster; pure Python), its devices and the one place strategies are built
(devices.py: GPUs, logical GPUs or K logical CPUs), and TensorFlow's quiet start
(startup.py)."""
