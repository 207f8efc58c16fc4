"""What runs a step: the runner executes a StepPlan's moves (runner.py) on the executor's forward
(executor.py), in a workspace planned once (workspace.py, memory.py predicts it, memory_probe.py
measures it), and turns logits into results (outputs.py)."""
