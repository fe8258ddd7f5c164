import sys

from jaxspec.serve.launch import main

sys.exit(main())
