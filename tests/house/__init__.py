"""Tests of the repository itself: layers, deployment recipes, the tree without an install, the GPU check."""
