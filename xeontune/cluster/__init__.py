"""Clusters: state records, the hosts and SSH files, SSH, and the providers that supply nodes."""
