"""Knowledge distillation (docs/peft.md): loss.py (KL over vocabulary-parallel logits, hidden-state MSE),
teacher.py (the frozen teacher in the student's ranks and layout, pruned student initialisation)."""
