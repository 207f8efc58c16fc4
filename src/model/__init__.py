"""The model's description and its weights: what a checkpoint says (spec.py), how its tensors load
(weights.py), rotary positions (rope.py) and the embedded default model (default_model.py)."""
