"""Publishing to the Hugging Face Hub: the uploader (``client``), the data root's README
(``readme``) and the ``publish`` verb (``publish``)."""
