from llmopt.cli.main import main

main()
