"""The math of the objectives: small pure functions over tensors, one file each, with the paper
cited and hand-worked tests (``ppo``, ``grpo``, ``sft``; ``advantages``, ``masking``, ``surrogate``).
Which objective runs, and how its inputs are built, is a recipe: services/trainer/recipes/.
"""
