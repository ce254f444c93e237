"""The local machine: GPU detection (`--gpus auto`), microbenchmarks (`measure`), real runs of a plan
(`check`) and GPU prices."""
