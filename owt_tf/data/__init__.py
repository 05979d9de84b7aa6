"""Datasets and the input pipeline."""
