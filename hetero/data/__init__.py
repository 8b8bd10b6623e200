"""Datasets built from real data that is already on the machine, so training and tests run offline."""
