"""The plan of a run, in pure Python: no module here imports TensorFlow (a test says so).

    plan.py        ParallelPlan (the one dataclass that spells the plan's fields) and
                   StepRounds (the rounds of one step at K replicas of B rows)
    ledger.py      the byte ledger: what each collective costs and the record of a step's
    traffic.py     the closed-form bytes per step of each scheme (the tests' oracle)
    cost_model.py  predicted step time of a scheme on a hardware
    hardware.py    hardware presets and the measurement of this machine
    auto.py        scheme="auto": the planner's choice for a model and hardware

`python -m owt_tf.plan` is the command line on top of it.
"""
