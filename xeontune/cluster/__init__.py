"""Clusters: state records, files for mpirun and accelerate, SSH, and the providers that create nodes."""
