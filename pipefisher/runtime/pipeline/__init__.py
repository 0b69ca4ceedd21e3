"""The executor core: one rank runs its actions of a plan, with its stages, clock and communication."""
