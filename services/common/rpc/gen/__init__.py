"""Generated from proto/rlhf/v1 by build_protos.py; do not edit."""
