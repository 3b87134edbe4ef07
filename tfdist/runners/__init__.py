"""Where a job's tasks run besides `tfdist.launch`: Spark barrier stages, Ray actors, and
the child process each task's function runs in."""
