"""What one attempt asks of `checkpoint.remote`: connect, apply a resume request once (`new_run`), choose
the step every rank resumes from (`choose`), upload while training (`uploader`), flush on exit (`run`)."""
