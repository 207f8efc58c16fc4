"""The fleet's endpoint picker: which replica completes a request soonest, from each replica's
published backlog and JCT model and the prefix blocks it is believed to hold (choice.py). The
fleet simulator (perf/simulate.py, routing "picker") runs the same code. Tensor-free."""
