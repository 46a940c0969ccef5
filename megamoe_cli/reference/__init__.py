"""What results are checked against: the number formats and their quantizers (``quant``), the
FP32-accumulating reference layer (``layer``) and the error bounds (``tolerance``).

Nothing is re-exported here: ``problem`` imports ``reference.quant``, and ``reference.layer``
imports ``problem``, so a package that imported ``layer`` on entry would close that circle."""
