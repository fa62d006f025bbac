"""Code the tests share: readers of what runs wrote, and hooks injected into jobs."""
