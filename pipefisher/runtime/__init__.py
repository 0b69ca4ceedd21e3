"""Running plans on torch.distributed: topology, communication, stage buffers, executor, launcher."""
