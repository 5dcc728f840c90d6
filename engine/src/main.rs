fn main() {
    use mlx_rs::Array;
    let a = Array::from_slice(&[1.0f32, 2.0, 3.0], &[3]);
    let b = a.multiply(&a).unwrap();
    b.eval().unwrap();
    println!("{:?} mlx {}", b.as_slice::<f32>(), mlx_sys::MLX_BUILD_VERSION);
}
