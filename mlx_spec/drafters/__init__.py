"""Drafters behind one interface: draft model, n-gram prompt lookup."""
