from autoloop.cli import main

main()
