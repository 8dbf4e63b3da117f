"""What one attempt asks of `checkpoint.remote`, in order (`run`: `RemoteRun`): connect, apply a resume request
once (`new_run`), fetch the run files a machine lacks (`run_files`), choose the step every rank resumes from
(`choose`) and copy it to the nodes that lack it (`nodes`), upload while training (`uploader`), flush on exit."""
