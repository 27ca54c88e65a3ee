use clap::Parser;

fn main() -> anyhow::Result<()> {
    let cli = gpubudget_operator::cli::Cli::parse();
    std::process::exit(gpubudget_operator::cli::dispatch(cli)?)
}
